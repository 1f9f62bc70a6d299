"""Small helpers every kerasmp package uses: layer paths (`layers.walk`),
text tables (`table.render_table`), NumPy reads (`arrays`), the devices the
backend sees (`devices`), layer-name pattern matching (`namematch`), the
mixin of the per-layer policies (`marked`) and the checks of a path before
writing to it (`paths`). None imports another kerasmp package."""
