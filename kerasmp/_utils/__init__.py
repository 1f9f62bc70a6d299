"""Small helpers every kerasmp package uses: layer paths (`layers.walk`),
text tables (`table.render_table`), NumPy reads (`arrays`), the devices the
backend sees (`devices`), layer-name pattern matching (`namematch`), the
mixin of the per-layer policies (`marked`), the checks of a path before
writing to it (`paths`) and the extra that brings a missing framework
(`requires`). None imports another kerasmp package."""
