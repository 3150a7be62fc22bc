"""The validation corpus (issue 21): every measured figure prism's step-time and memory models are held against.

`rows` (the data files: source, hardware, precision, model, layout, measured figures, prism command, role),
`runner` (predict a row, stamp its result with `fingerprint`'s model fingerprint), `table` (the table of the
results document, fit and validate apart, stale results marked). One command: ``python -m validation.corpus``.
"""
