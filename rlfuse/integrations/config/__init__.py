"""Hydra configs of the verl recipes (``verl_gr_opd``)."""
