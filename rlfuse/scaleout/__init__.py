"""Scale-out: the layout of a policy's rows (a window of a whole output, packed rows) and the
vocabulary split over a process group, shared by both implementations (``layout``, ``vocab``),
the fused split (``vocab_op``) and the global counts of data parallelism
(``data_parallel``)."""
