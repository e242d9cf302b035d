"""Figures and widgets on top of the library: plots with labels in words (``plots``, ``labels``),
PNG/PDF/SVG export in a paper style (``figures``), the steppers' live fitness plot (``live``) and the
ES stepper's controls (``stepper``)."""
