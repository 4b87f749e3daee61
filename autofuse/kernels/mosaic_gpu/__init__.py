"""The Mosaic GPU (Pallas `plgpu`: TMA, wgmma, warp specialisation; Hopper) lowerings of the templates.

`<template>.lower(group, spec, config, *, interpret)` per template (today: `matmul`); `tiles.py` evaluates a group's
elementwise equations on Mosaic GPU register arrays (WGMMA layouts).
"""
