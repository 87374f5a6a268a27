# tests/lib/tiny.sh — the config of the tiny model the shell tests of the real dgtrain train (sourced by
# tests/slurm/lib.sh and tests/sample/lib.sh); a test changes what it needs with --set.
# shellcheck shell=bash

# write_tiny_config FILE STEPS: the tiny preset, small batches, one thread per rank (so runs at 1 and 2
# ranks share the 2 cores without oversubscription), no validation, checkpoints at the end and on signals.
write_tiny_config() {
    cat >"$1" <<INI
; written by tests/lib/tiny.sh for the end-to-end tests of the real dgtrain
[run]
name = e2e
seed = 4242
[model]
preset = tiny
[data]
val_every = 0
[train]
steps = $2
global_batch = 8
micro_batch = 2
log_every = 1
[parallel]
backend = cpu
threads = 1
[checkpoint]
every = 0
resume = auto
[health]
heartbeat_s = 1
; long: a synchronous checkpoint write in the sanitizer build on a loaded box has taken over 30 s
timeout_s = 300
INI
}
