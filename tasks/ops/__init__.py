"""Operations: an operator's send and its order, retry and cancel, listings, queues, the janitor."""
