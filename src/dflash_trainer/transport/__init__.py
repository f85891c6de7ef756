"""The hidden states' way from a target to a drafter: the wire form, point-to-point transfer, the sender thread,
the claims and credits in the store, the receiver and the buffered pool."""
