"""Pick an off-screen OpenGL backend before MuJoCo is imported (it reads MUJOCO_GL once, at import).

EGL works headless through Mesa's software renderer; OSMesa is the fallback where no libEGL exists;
GLFW needs a display, so it is never chosen here. A value the user set is always kept.
"""

from __future__ import annotations

import atexit
import ctypes.util
import gc
import os
import sys
import weakref


def select_gl_backend() -> str:
    """Set MUJOCO_GL (and PyOpenGL's platform to match) if unset; returns the backend in use."""
    if "MUJOCO_GL" not in os.environ and "mujoco" not in sys.modules:
        backend = "egl" if ctypes.util.find_library("EGL") or not ctypes.util.find_library("OSMesa") else "osmesa"
        os.environ["MUJOCO_GL"] = backend
    backend = os.environ.get("MUJOCO_GL", "egl")
    if backend in ("egl", "osmesa"):
        os.environ.setdefault("PYOPENGL_PLATFORM", backend)
    return backend


_OPEN: weakref.WeakSet = weakref.WeakSet()


def close_at_exit(env) -> None:
    """Close `env` at interpreter exit if it is still open. Call it right after the env opened its
    GL context. EGL users (MuJoCo, robosuite) register eglTerminate at exit when they open the shared
    display, and atexit runs last-registered first: so the hook is moved to the end of the queue on
    every call, and it frees the contexts while the display is still open (otherwise every
    renderer left open prints a screenful of EGL errors at exit)."""
    _OPEN.add(env)
    atexit.unregister(_close_open_envs)
    atexit.register(_close_open_envs)


def _close_open_envs() -> None:
    for env in list(_OPEN):
        env.close()
    # robosuite frees its GL contexts only in the __del__ of objects in reference cycles (also of
    # envs dropped without close): collect them now, while the display is still open.
    gc.collect()
