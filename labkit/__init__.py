"""labkit: the prefill/decode lab's library — specs, roofline formulas, calibration,
measurement, a Llama-shaped model, sweeps and views. The core imports without Jupyter
packages (a GPU image has only torch, triton and numpy); `labkit.views` needs plotly/ipywidgets."""
