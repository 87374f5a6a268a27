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

# shellcheck disable=SC2206
DG_PACKAGES+=(${DG_EXTRA_PACKAGES:-})

missing=()
for p in "${DG_PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$p")
    fi
done

if [ ${#missing[@]} -eq 0 ]; then
    echo "setup: all ${#DG_PACKAGES[@]} packages are installed"
    exit 0
fi
echo "setup: missing ${#missing[@]} package(s): ${missing[*]}"
if [ "${1:-}" = "--check" ]; then
    exit 1
fi

sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        sudo_cmd=(sudo)
    else
        echo "setup: not root and no sudo: install the packages above as root" >&2
        exit 1
    fi
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -q
"${sudo_cmd[@]}" apt-get install -y -q "${missing[@]}"
echo "setup: installed ${missing[*]}"
