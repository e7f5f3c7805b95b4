"""Trainer-side embedding tables: the dynamic ``HashTable``, its initializers, the sparse
optimizers that update only touched rows, and ``ShardedEmbedding`` over torch.distributed."""
