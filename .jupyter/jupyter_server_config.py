# JupyterLab settings for this project, read by `evolm lab` (which puts this folder first on
# JUPYTER_CONFIG_PATH). With plain jupyter: JUPYTER_CONFIG_PATH=.jupyter jupyter lab
from pathlib import Path

c = get_config()  # noqa: F821 - provided by Jupyter when it loads this file

# Saves of notebooks/*.ipynb drop outputs, execution counts and the lab's own metadata, so the tracked
# notebook holds what its paired .py holds and running a notebook leaves no diff. Notebooks elsewhere
# (runs/, your own) keep their outputs.
c.ContentsManager.pre_save_hook = "evolm_lib.cli.lab.clean_notebook_save"

# The lab's default settings (lab/settings/overrides.json beside this file): no autosave, so a notebook
# reaches the disk (and its tracked .py and .ipynb) only when saved on purpose, with Ctrl-S or
# File > Save; and a percent-format .py opens as a notebook on a double click. Your own settings
# (Settings > Settings Editor) still win over these. JupyterLab's question whether to fetch its news
# from the internet (a pop-up over every notebook until answered) is answered "no" (fetchNews "false").
c.LabApp.app_settings_dir = str(Path(__file__).resolve().parent / "lab" / "settings")
