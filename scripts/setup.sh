#!/bin/bash
# scripts/setup.sh — install the Debian 12 packages dgtrain needs to build, test and run.
#
# Idempotent: packages already installed are left alone, and when nothing is missing it changes
# nothing (no apt-get update either). Non-interactive; runs as root, or through sudo for a normal user.
#
#   scripts/setup.sh            install what is missing
#   scripts/setup.sh --check    list what is missing, install nothing (exit 1 if anything is)
#
# Extra packages for one run: DG_EXTRA_PACKAGES="pkg1 pkg2" scripts/setup.sh
#
# After the packages, two steps that need PyPI only when their result is missing or stale:
# - the test virtual environment ($DG_TEST_VENV, default /opt/dgtrain/test-venv): Debian's
#   /usr/bin/python3 with --system-site-packages (numpy, h5py stay visible) plus
#   scripts/requirements-test.txt (Python oracles of the tests, e.g. tiktoken); rebuilt when that file
#   changes (its SHA-256 is kept in the venv).
# - the GPT-2 BPE ranks for dgprep --tokenizer gpt2 ($DG_SHARE_DIR, default /usr/local/share/dgtrain,
#   file gpt2.tiktoken): taken from the openai-whisper sdist on PyPI (pip download only: installing it
#   would pull PyTorch), checked against a pinned SHA-256.
set -euo pipefail

# Build and core runtime: compiler and tools, Open MPI, parallel HDF5 (openmpi flavour; a serial HDF5
# is refused by CMake), hwloc, OpenBLAS (CBLAS), libinih, xxhash; Python with numpy and h5py for the
# tests that read checkpoints and metrics.
DG_PACKAGES=(
    build-essential cmake ninja-build pkg-config
    libopenmpi-dev openmpi-bin
    libhdf5-openmpi-dev hdf5-tools
    libhwloc-dev hwloc
    libopenblas-dev
    libinih-dev
    libxxhash-dev
    python3 python3-numpy python3-h5py
)
# Packages other parts of dgtrain need: each module adds one line here, saying what it is for.
# DG_PACKAGES+=(package ...)   # module: why
DG_PACKAGES+=(slurmctld slurmd slurm-client munge) # health/slurm: the one-node test cluster (tests/slurm/cluster.sh)
DG_PACKAGES+=(libpcre2-dev python3-venv) # tokenizer: GPT-2 pre-tokenization regex; the test venv (tiktoken)
DG_PACKAGES+=(librsvg2-bin) # plot: rsvg-convert renders every chart in tests/plot (its absence fails under CI)

# shellcheck disable=SC2206
DG_PACKAGES+=(${DG_EXTRA_PACKAGES:-})

missing=()
for p in "${DG_PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$p")
    fi
done

sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        sudo_cmd=(sudo)
    elif [ "${1:-}" != "--check" ]; then
        echo "setup: not root and no sudo: install the packages above as root" >&2
        exit 1
    fi
fi

if [ ${#missing[@]} -eq 0 ]; then
    echo "setup: all ${#DG_PACKAGES[@]} packages are installed"
else
    echo "setup: missing ${#missing[@]} package(s): ${missing[*]}"
    if [ "${1:-}" = "--check" ]; then
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    "${sudo_cmd[@]}" apt-get update -q
    "${sudo_cmd[@]}" apt-get install -y -q "${missing[@]}"
    echo "setup: installed ${missing[*]}"
fi

# ---------------- test virtual environment (tokenizer and later Python oracles) ----------------
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${DG_TEST_VENV:-/opt/dgtrain/test-venv}
req=$root/scripts/requirements-test.txt
req_sum=$(sha256sum "$req" | cut -d' ' -f1)
if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.dg-requirements.sha256" 2>/dev/null)" = "$req_sum" ]; then
    echo "setup: test venv $venv is up to date"
elif [ "${1:-}" = "--check" ]; then
    echo "setup: test venv $venv is missing or stale"
    exit 1
else
    echo "setup: creating the test venv $venv from $req"
    "${sudo_cmd[@]}" mkdir -p "$(dirname "$venv")"
    "${sudo_cmd[@]}" /usr/bin/python3 -m venv --system-site-packages "$venv"
    "${sudo_cmd[@]}" "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$req"
    echo "$req_sum" | "${sudo_cmd[@]}" tee "$venv/.dg-requirements.sha256" >/dev/null
fi

# ---------------- GPT-2 BPE ranks (dgprep --tokenizer gpt2; docs/data.md) ----------------
# gpt2.tiktoken is GPT-2's 50256 byte-level BPE ranks (tiktoken's r50k_base); openai-whisper ships it.
DG_WHISPER_VERSION=20250625
DG_GPT2_TIKTOKEN_SHA256=306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930
share=${DG_SHARE_DIR:-/usr/local/share/dgtrain}
ranks=$share/gpt2.tiktoken
if [ -f "$ranks" ] && [ "$(sha256sum "$ranks" | cut -d' ' -f1)" = "$DG_GPT2_TIKTOKEN_SHA256" ]; then
    echo "setup: GPT-2 ranks $ranks are installed"
elif [ "${1:-}" = "--check" ]; then
    echo "setup: GPT-2 ranks $ranks are missing"
    exit 1
else
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    echo "setup: fetching gpt2.tiktoken from openai-whisper==$DG_WHISPER_VERSION (download only)"
    "$venv/bin/python" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
        -d "$tmp" "openai-whisper==$DG_WHISPER_VERSION"
    tar -xzf "$tmp"/openai_whisper-*.tar.gz -C "$tmp" --wildcards '*/whisper/assets/gpt2.tiktoken'
    got=$(sha256sum "$tmp"/openai_whisper-*/whisper/assets/gpt2.tiktoken | cut -d' ' -f1)
    if [ "$got" != "$DG_GPT2_TIKTOKEN_SHA256" ]; then
        echo "setup: gpt2.tiktoken from openai-whisper has SHA-256 $got, expected $DG_GPT2_TIKTOKEN_SHA256" >&2
        exit 1
    fi
    "${sudo_cmd[@]}" install -D -m 0644 "$tmp"/openai_whisper-*/whisper/assets/gpt2.tiktoken "$ranks"
    echo "setup: installed $ranks"
fi
