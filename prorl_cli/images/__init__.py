"""Image builds: Jinja recipes rendered to Apptainer definitions, built and cached by mode.

Public API: :func:`resolve_image` (node servers: image name -> .sif path),
:class:`~prorl_cli.images.cache.Cache`, :func:`~prorl_cli.images.spec.load_image_specs`,
:func:`~prorl_cli.images.plan.plan_images` and :class:`~prorl_cli.images.build.Builder`;
:mod:`~prorl_cli.images.published` names published per-instance images (``--images-from``).
"""

from __future__ import annotations

from prorl_cli.images.cache import Cache, resolve_image

__all__ = ["Cache", "resolve_image"]
