"""From records to what a reader sees: pooled metrics, tables, figures, exports, the paper's grid and claims, and the
regression gate."""
