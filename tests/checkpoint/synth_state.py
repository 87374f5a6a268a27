"""synth_state.py — what the Python checks of ckpt_driver's synthetic checkpoint state (`save --seed
SEED`) share with the driver (tests/checkpoint/ckpt_driver.c): fnv1a, the hash of a dataset path that
its value formula (idx * 2654435761 + fnv1a(path) + seed * 97 mod 2^32) uses."""


def fnv1a(s):
    """32-bit FNV-1a of the UTF-8 bytes of s"""
    h = 2166136261
    for c in s.encode():
        h = ((h ^ c) * 16777619) & 0xFFFFFFFF
    return h
