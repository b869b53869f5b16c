"""The floor every method stands on: the staged target, model loading, checkpoints, paths, the record store, the
greedy reference and the rank group. Imports nothing else of the project."""
