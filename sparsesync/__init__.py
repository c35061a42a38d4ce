"""sparsesync: move RL weight updates as sparse, digest-checked safetensors patches through a bucket.

The library: change detection and the patch codec (`sparsesync.codec`), object stores
(`sparsesync.store`), the bucket protocol with its publisher and follower
(`sparsesync.protocol`), and the `sparsesync` CLI (`sparsesync.cli`).
"""

__version__ = "0.1.0"
