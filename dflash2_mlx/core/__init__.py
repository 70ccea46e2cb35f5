"""The decoding core: one draft-verify cycle, its caches and rollback, sampling and
verification, the width policy, and the batch of rows; nothing here loads models or serves."""
