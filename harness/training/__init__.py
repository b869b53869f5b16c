"""Drafter training: corpus, teacher features, the loop, held-out decoding figures and training throughput."""
