"""Many hosts: shard directory, global sampling across shards, transports.

The store layer holds one shard; this layer makes many shards (one per owner
rank, each in shared memory on its host) read like one.
"""
