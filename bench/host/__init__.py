"""Host-side work on the device machine: tokenizing in worker processes, batched decoding, CPU scaling."""
