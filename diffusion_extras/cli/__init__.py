"""The command lines besides training (sample, evaluate, post-hoc EMA) and what they share."""
