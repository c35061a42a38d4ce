"""Deploying the apps of a disaggregated run as Hugging Face Spaces.

`space.py` is generic (render a Docker Space from app files, variables, secrets, hardware and an
optional region; plan; apply through huggingface_hub); one module per app builds its `SpaceSpec`:
`env.py` for the environment server. Nothing here touches the network before `space.apply`.
"""

from __future__ import annotations

from sparsesync.deploy.space import SpacePlan, SpaceSpec, apply, plan, render

__all__ = ["SpacePlan", "SpaceSpec", "apply", "plan", "render"]
