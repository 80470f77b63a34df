"""Multi-dimensional tensor parallelism: 2-D (Optimus: SUMMA on a q×q grid), 2.5-D (Tesseract: d stacked
q×q grids) and 3-D (Bian et al.: a q×q×q cube). Weights and activations are both split over the grid, and
every layer's communication is written out in autograd functions (comm.py, summa.py, cube.py).

The weights are DTensor parameters on the tensor-parallel sub-mesh, under the model's own names, so
initialisation, the optimizer, gradient norms and checkpoints see the same model as under any other layout;
the layers compute on their local blocks (`to_local()`)."""
