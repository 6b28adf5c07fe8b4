"""Pick an off-screen OpenGL backend before MuJoCo is imported (it reads MUJOCO_GL once, at import).

EGL works headless through Mesa's software renderer; OSMesa is the fallback where no libEGL exists;
GLFW needs a display, so it is never chosen here. A value the user set is always kept.
"""

from __future__ import annotations

import ctypes.util
import os
import sys


def select_gl_backend() -> str:
    """Set MUJOCO_GL (and PyOpenGL's platform to match) if unset; returns the backend in use."""
    if "MUJOCO_GL" not in os.environ and "mujoco" not in sys.modules:
        backend = "egl" if ctypes.util.find_library("EGL") or not ctypes.util.find_library("OSMesa") else "osmesa"
        os.environ["MUJOCO_GL"] = backend
    backend = os.environ.get("MUJOCO_GL", "egl")
    if backend in ("egl", "osmesa"):
        os.environ.setdefault("PYOPENGL_PLATFORM", backend)
    return backend
