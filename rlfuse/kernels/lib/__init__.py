"""What the kernels share: launch helpers and flags (``utils``), a row's passes
(``row_functions``), a head's scalars and softcap (``head_functions``), the per-token objectives
(``token_functions``), the divergences (``divergence_functions``) and the trust regions
(``regions``, with the kernel that exports GPPO's bounds)."""
