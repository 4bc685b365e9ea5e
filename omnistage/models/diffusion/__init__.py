"""Diffusion model families: diffusers-format pipeline folders, served by the diffusion stage.

``components``: reading a diffusers folder (which component is which, built on ``meta``);
``pipeline``: ``LoadedPipeline``, a folder's modules in a stage arena, family-agnostic;
``family``: ``DiffusionFamily``, the adapter interface a family implements; one module per
family (``pixart``) exposes ``FAMILY``. The stage reaches a family only through
``omnistage.models.registry.family_of_folder``.
"""
