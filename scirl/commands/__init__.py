"""Thin command-line front ends. Each module exposes ``main(argv) -> int``.

The library code lives in the other ``scirl`` modules; these files only parse
arguments, call it, and print. They import heavy dependencies (torch,
transformers) lazily so that ``scirl data stats`` starts in well under a second.

May import: any layer.
"""
