"""Offscreen MuJoCo rendering shared by the MuJoCo environments (navigation, manipulation): the
OpenGL backend chosen before `mujoco` is first imported, one lazily opened `mujoco.Renderer` per
scene, and every open renderer closed at interpreter exit.

`MUJOCO_GL` defaults to `egl` (software rendering through Mesa works on CPU-only machines);
`osmesa` is the alternative. It must be set before `mujoco` is first imported in the process, so
the scene modules import `mujoco` from here.
"""

from __future__ import annotations

import atexit
import os
import sys
import weakref

# mujoco picks its OpenGL backend when first imported; remember whether that already happened
IMPORTED_WITH_GL = os.environ.get("MUJOCO_GL") if "mujoco" in sys.modules else "unchanged"
os.environ.setdefault("MUJOCO_GL", "egl")

import mujoco  # noqa: E402  (MUJOCO_GL must be set before the first import)

_open_scenes: weakref.WeakSet = weakref.WeakSet()
_atexit_registered = False


def _close_open_scenes() -> None:
    for scene in list(_open_scenes):
        scene.close()


class OffscreenScene:
    """A scene with `model`, `width` and `height` that renders through one `mujoco.Renderer`,
    opened on the first frame with shadows, reflections and the skybox off. `env_name` names the
    environment in the error raised when no OpenGL context can be opened."""

    env_name = ""
    _renderer: mujoco.Renderer | None = None

    @property
    def renderer(self) -> mujoco.Renderer:
        global _atexit_registered
        if self._renderer is None:
            try:
                self._renderer = mujoco.Renderer(self.model, height=self.height, width=self.width)
            except Exception as error:
                early = ("" if IMPORTED_WITH_GL == "unchanged" else
                         f"; mujoco was imported before envs_visual with MUJOCO_GL={IMPORTED_WITH_GL!r}")
                raise RuntimeError(
                    f"could not open an offscreen OpenGL context (MUJOCO_GL={os.environ.get('MUJOCO_GL')!r}"
                    f"{early}): {error}. Set MUJOCO_GL=egl (or osmesa) in the environment before Python starts, "
                    "or import envs_visual before anything imports mujoco; EGL needs the Debian packages "
                    "libegl1 libegl-mesa0 libgl1-mesa-dri (osmesa: libosmesa6). Check with: MUJOCO_GL=egl python "
                    f"-c \"import envs_visual; e = envs_visual.make('{self.env_name}'); "
                    "print(e.reset(seed=0)[0].images[0].size)\""
                ) from error
            _open_scenes.add(self)
            if not _atexit_registered:
                # registered after the GL backend's own exit hook, so it runs first: renderers are freed
                # while their GL library still works (osmesa otherwise complains at interpreter exit)
                atexit.register(_close_open_scenes)
                _atexit_registered = True
            flags = self._renderer.scene.flags
            for flag in (mujoco.mjtRndFlag.mjRND_SHADOW, mujoco.mjtRndFlag.mjRND_REFLECTION,
                         mujoco.mjtRndFlag.mjRND_SKYBOX):
                flags[flag] = False
        return self._renderer

    def close(self) -> None:
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None
        _open_scenes.discard(self)
