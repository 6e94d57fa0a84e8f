"""The batch-invariant kernels, on tiles formed on the chip: the fixed-order matmul (``matmul``),
a head's tiles (``head_tiles``), a student's and a teacher's (``distill_tiles``) and the
vocabulary blocks' statistics, combined in one order (``tile_stats``)."""
