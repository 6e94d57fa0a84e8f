"""Development tools, run from the repository root (``python -m tools.<name>``); not part of the
package:

- ``compile_only``: Triton's driver replaced by one that compiles and does not launch (what
  ``gpu_compile`` and ``sass`` drive the kernels through);
- ``gpu_compile``: every kernel variant compiled for a GPU (sm_90 by default) on a machine without
  one, its registers and spills read from the cubin;
- ``sass``: instructions per logit of every row kernel, from its SASS, and the issue / MUFU /
  memory model;
- ``traffic``: the bytes every kernel moves per row of logits, counted in the Triton interpreter,
  and the bytes a vocabulary split sends per call.

``sass`` and ``traffic`` run the cases of ``bench.cases``, the one registry of what is measured.
"""
