"""Data plane: read windows of a remote shard's rows into local tensors.

One interface (``base.Transport``), three ways: ``tcp`` (portable), ``local``
(same host, shared memory) and ``rdma`` (one-sided reads, pyverbs).
"""
