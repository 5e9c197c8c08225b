"""The CRC-32 (zlib's) that the converter records and the readers check on every expert they read.

zlib-ng's implementation, which gives zlib's values: a decode through the disk tier checks every byte it reads,
2.6 GB a token on the 30 GB bench checkpoint (bench.disk_tier), and zlib's CRC ran at 2.9 GB/s on this project's
Zen 4 guest against zlib-ng's 27.7 GB/s (40 MB buffers, 2026-11-27).
"""

try:
    from zlib_ng.zlib_ng import crc32
except ImportError:  # jmoe installed without its dependencies (a lent GPU's image): zlib's, the same values
    from zlib import crc32

__all__ = ["crc32"]
