"""Kernels over ``[B, T]`` log-probs and groups of rows: GGPO (``ggpo``), GR-OPD's advantages
(``gr_opd``) and the KL penalty (``kl``)."""
