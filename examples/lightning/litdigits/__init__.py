"""A Lightning project: an MLP on scikit-learn's 8x8 digits, its data (plain or resumable) and the
checkpointing defects the tests plant."""
