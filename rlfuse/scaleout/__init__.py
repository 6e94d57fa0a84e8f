"""Scale-out: the layout of a policy's rows (a window of a whole output, packed rows) and the
vocabulary split over a process group, shared by both implementations (``layout``, ``vocab``),
sequence parallelism over the split (``sequence``), context parallelism's whole sequences
(``context``), a split read from DTensors (``dtensor``,
``rank_rows``) and the global counts of data parallelism (``data_parallel``)."""
