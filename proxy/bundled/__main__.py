"""`python -m proxy.bundled` prints the bundled model directory (the image links to it)."""

from proxy.bundled import bundled_model_dir

print(bundled_model_dir())
