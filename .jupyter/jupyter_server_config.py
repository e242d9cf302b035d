# JupyterLab settings for this project, read by `evolm lab` (which puts this folder first on
# JUPYTER_CONFIG_PATH). With plain jupyter: JUPYTER_CONFIG_PATH=.jupyter jupyter lab
c = get_config()  # noqa: F821 - provided by Jupyter when it loads this file

# Saves of notebooks/*.ipynb drop outputs, execution counts and the lab's own metadata, so the tracked
# notebook holds what its paired .py holds and running a notebook leaves no diff. Notebooks elsewhere
# (runs/, your own) keep their outputs.
c.ContentsManager.pre_save_hook = "evolm_lib.cli.lab.clean_notebook_save"
