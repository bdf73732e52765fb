"""The MuJoCo side of the navigation environment: object templates read from
`assets/navigation/*.xml`, the scene model with a fixed pool of wall and object slots, and the
offscreen renderer.

One `NavigationScene` per environment compiles one model and opens one `mujoco.Renderer`. A new
level only rewrites arrays of that model (wall sizes, object slot poses and colours, which slots
are shown); a new camera pose only sets the agent's mocap pose and runs `mj_kinematics` + `mj_camlight`. Nothing
is recompiled and no GL context is created after the first frame.

Rendering (the `MUJOCO_GL` backend, the renderer's lifetime) is `envs_visual.mujoco_render`'s.
"""

from __future__ import annotations

import copy
import math
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from functools import cache

import numpy as np

from envs_visual.assets import asset_path
from envs_visual.mujoco_render import OffscreenScene, mujoco

# Object kinds, in the order their template files are read; the name is the shape word used in
# instructions ("the red table").
OBJECT_KINDS = ("table", "chair", "cabinet", "lamp", "ball", "barrel", "sofa", "pyramid")

# Colour names and RGB; chosen to be far apart from each other and from the grey-beige room.
COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (0.85, 0.10, 0.10),
    "green": (0.10, 0.65, 0.15),
    "blue": (0.12, 0.25, 0.90),
    "yellow": (0.95, 0.85, 0.10),
    "purple": (0.55, 0.15, 0.75),
    "orange": (1.00, 0.50, 0.05),
    "cyan": (0.10, 0.80, 0.85),
    "pink": (1.00, 0.45, 0.70),
}

# Colours of the room, for tests and the top-down map.
FLOOR_RGB = (0.51, 0.47, 0.42)
WALL_RGB = (0.78, 0.77, 0.73)

WALL_HEIGHT = 2.5
NEAR_CLIP, FAR_CLIP = 0.03, 60.0  # metres
HIDDEN_GROUP = 5  # geom group of unused slots; disabled in the renderer's scene option
MAX_PER_KIND = 2  # a level holds at most this many objects of one kind (with different colours)


@dataclass(frozen=True)
class ObjectTemplate:
    """One object kind: its XML and its axis-aligned extent in the template frame (metres)."""

    kind: str
    root: ET.Element  # the template file's <mujoco> element
    xmin: float
    xmax: float
    ymin: float
    ymax: float
    height: float
    paint_height: float  # height of the middle of the coloured parts (where to look to see the colour)


def _floats(text: str | None, default: str) -> list[float]:
    return [float(v) for v in (text or default).split()]


def _geom_extent(geom: ET.Element, meshes: dict[str, np.ndarray], where: str) -> np.ndarray:
    """[xmin, ymin, zmin, xmax, ymax, zmax] of one template geom."""
    for attr in ("quat", "euler", "axisangle", "xyaxes", "zaxis", "fromto"):
        if attr in geom.attrib:
            raise ValueError(
                f"{where}: geom has '{attr}'; navigation templates may only use pos and size so that the "
                "footprint can be derived; build rotated parts from unrotated boxes/cylinders instead"
            )
    kind = geom.get("type", "sphere")
    pos = np.array(_floats(geom.get("pos"), "0 0 0"))
    size = _floats(geom.get("size"), "0")
    if kind == "box":
        half = np.array(size[:3])
    elif kind in ("cylinder", "capsule"):
        half = np.array([size[0], size[0], size[1] + (size[0] if kind == "capsule" else 0.0)])
    elif kind == "sphere":
        half = np.array([size[0]] * 3)
    elif kind == "ellipsoid":
        half = np.array(size[:3])
    elif kind == "mesh":
        vertices = meshes[geom.get("mesh")]
        return np.concatenate([vertices.min(0) + pos, vertices.max(0) + pos])
    else:
        raise ValueError(f"{where}: geom type {kind!r} not supported; use box, cylinder, capsule, sphere, "
                         "ellipsoid or mesh")
    return np.concatenate([pos - half, pos + half])


@cache
def object_templates() -> dict[str, ObjectTemplate]:
    """Read every `assets/navigation/<kind>.xml` once."""
    templates = {}
    for kind in OBJECT_KINDS:
        path = asset_path("navigation", f"{kind}.xml")
        root = ET.parse(path).getroot()
        meshes = {
            m.get("name"): np.array(_floats(m.get("vertex"), "")).reshape(-1, 3) for m in root.iter("mesh")
        }
        geoms = list(root.find("worldbody").iter("geom"))
        extents = np.array([_geom_extent(g, meshes, str(path)) for g in geoms])
        lo, hi = extents[:, :3].min(0), extents[:, 3:].max(0)
        paint = extents[[g.get("class", "paint") == "paint" for g in geoms]]
        templates[kind] = ObjectTemplate(kind, root, float(lo[0]), float(hi[0]), float(lo[1]), float(hi[1]),
                                         float(hi[2]), float(paint[:, 2].min() + paint[:, 5].max()) / 2)
    return templates


def footprint(kind: str, x: float, y: float, yaw_deg: float) -> tuple[float, float, float, float]:
    """Floor rectangle (xmin, ymin, xmax, ymax) of an object of `kind` at (x, y) turned by `yaw_deg`
    (a multiple of 90)."""
    t = object_templates()[kind]
    c, s = round(math.cos(math.radians(yaw_deg))), round(math.sin(math.radians(yaw_deg)))
    corners = [(c * px - s * py, s * px + c * py) for px in (t.xmin, t.xmax) for py in (t.ymin, t.ymax)]
    xs, ys = [p[0] for p in corners], [p[1] for p in corners]
    return (round(x + min(xs), 9), round(y + min(ys), 9), round(x + max(xs), 9), round(y + max(ys), 9))


def yaw_pitch_quat(yaw_deg: float, pitch_deg: float) -> np.ndarray:
    """Quaternion (w, x, y, z) of a body turned by yaw about z, then tilted up by pitch."""
    yaw, pitch = math.radians(yaw_deg) / 2, -math.radians(pitch_deg) / 2
    q_yaw = np.array([math.cos(yaw), 0.0, 0.0, math.sin(yaw)])
    q_pitch = np.array([math.cos(pitch), 0.0, math.sin(pitch), 0.0])
    out = np.zeros(4)
    mujoco.mju_mulQuat(out, q_yaw, q_pitch)
    return out


def scene_xml(num_walls: int, width: int, height: int, fov: float) -> str:
    """The scene model: room.xml plus `num_walls` wall boxes and MAX_PER_KIND slots per object kind
    (each a mocap body named `<kind>_<i>` holding the template's geoms, all hidden at first)."""
    root = ET.parse(asset_path("navigation", "room.xml")).getroot()
    root.find("visual/global").attrib.update(offwidth=str(width), offheight=str(height))
    root.find(".//camera[@name='eye']").set("fovy", f"{fov:g}")
    assets, world = root.find("asset"), root.find("worldbody")
    for i in range(num_walls):
        ET.SubElement(world, "geom", name=f"wall_{i}", type="box", size="0.05 0.05 0.05", pos="0 0 -10",
                      material="wall", group=str(HIDDEN_GROUP))
    for kind, template in object_templates().items():
        for mesh in template.root.iter("mesh"):
            assets.append(copy.deepcopy(mesh))
        defaults = {
            d.get("class"): d.find("geom").attrib for d in template.root.iter("default") if d.get("class")
        }
        for slot in range(MAX_PER_KIND):
            body = ET.SubElement(world, "body", name=f"{kind}_{slot}", mocap="true", pos="0 0 -10")
            for j, geom in enumerate(template.root.find("worldbody").iter("geom")):
                attrib = {**defaults.get(geom.get("class"), {}), **geom.attrib}
                role = "paint" if attrib.pop("class", "paint") == "paint" else "accent"
                attrib.update(name=f"{kind}_{slot}_{role}_{j}", material="paint", group=str(HIDDEN_GROUP))
                ET.SubElement(body, "geom", attrib)
    return ET.tostring(root, encoding="unicode")


class NavigationScene(OffscreenScene):
    """One compiled scene model and one offscreen renderer, reused for every level and frame."""

    env_name = "navigation"

    def __init__(self, num_walls: int, width: int = 128, height: int = 128, fov: float = 90.0,
                 eye_height: float = 1.5):
        self.width, self.height, self.eye_height = int(width), int(height), float(eye_height)
        self.model = mujoco.MjModel.from_xml_string(scene_xml(num_walls, self.width, self.height, fov))
        self.data = mujoco.MjData(self.model)
        m = self.model
        # clipping planes are in units of the model's extent; the camera may stand AGENT_RADIUS from a wall
        m.vis.map.znear = NEAR_CLIP / m.stat.extent
        m.vis.map.zfar = FAR_CLIP / m.stat.extent

        def gid(name: str) -> int:
            return mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_GEOM, name)

        self.wall_ids = [gid(f"wall_{i}") for i in range(num_walls)]
        self.floor_id, self.ceiling_id = gid("floor"), gid("ceiling")
        self.agent_mocap = m.body_mocapid[mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_BODY, "agent")]
        self.camera_id = mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_CAMERA, "eye")
        # slot name -> (mocap index, all geom ids, paint geom ids)
        self.slots: dict[str, tuple[int, list[int], list[int]]] = {}
        for kind in OBJECT_KINDS:
            for slot in range(MAX_PER_KIND):
                body = mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_BODY, f"{kind}_{slot}")
                geoms = [g for g in range(m.ngeom) if m.geom_bodyid[g] == body]
                paint = [g for g in geoms if "_paint_" in mujoco.mj_id2name(m, mujoco.mjtObj.mjOBJ_GEOM, g)]
                self.slots[f"{kind}_{slot}"] = (int(m.body_mocapid[body]), geoms, paint)
        self.option = mujoco.MjvOption()
        self.option.geomgroup[HIDDEN_GROUP] = 0
        self._renderer: mujoco.Renderer | None = None


    def load(self, room_width: float, room_depth: float, walls, objects) -> None:
        """Show one level. `walls`: (xmin, ymin, xmax, ymax) rectangles; `objects`: dicts with kind,
        colour, x, y, yaw (degrees)."""
        m, d = self.model, self.data
        if len(walls) > len(self.wall_ids):
            raise ValueError(f"level has {len(walls)} walls but the scene was built for {len(self.wall_ids)}; "
                             "build the scene with num_walls >= the largest level's wall count")
        for gid, wall in zip(self.wall_ids, list(walls) + [None] * (len(self.wall_ids) - len(walls))):
            if wall is None:
                m.geom_group[gid], m.geom_pos[gid] = HIDDEN_GROUP, (0, 0, -10)
                continue
            xmin, ymin, xmax, ymax = wall
            m.geom_pos[gid] = ((xmin + xmax) / 2, (ymin + ymax) / 2, WALL_HEIGHT / 2)
            m.geom_size[gid] = ((xmax - xmin) / 2, (ymax - ymin) / 2, WALL_HEIGHT / 2)
            m.geom_group[gid] = 0
        half = (room_width / 2 + 0.2, room_depth / 2 + 0.2)
        m.geom_pos[self.floor_id] = (room_width / 2, room_depth / 2, -0.05)
        m.geom_size[self.floor_id] = (*half, 0.05)
        m.geom_pos[self.ceiling_id] = (room_width / 2, room_depth / 2, WALL_HEIGHT + 0.05)
        m.geom_size[self.ceiling_id] = (*half, 0.05)
        used: dict[str, int] = {}
        shown = set()
        for obj in objects:
            slot = f"{obj['kind']}_{used.get(obj['kind'], 0)}"
            used[obj["kind"]] = used.get(obj["kind"], 0) + 1
            if slot not in self.slots:
                raise ValueError(f"level has more than {MAX_PER_KIND} objects of kind {obj['kind']!r}; "
                                 f"the scene holds at most {MAX_PER_KIND} per kind")
            mocap, geoms, paint = self.slots[slot]
            d.mocap_pos[mocap] = (obj["x"], obj["y"], 0.0)
            d.mocap_quat[mocap] = yaw_pitch_quat(obj["yaw"], 0.0)
            m.geom_group[geoms] = 0
            m.geom_rgba[paint] = (*COLOURS[obj["colour"]], 1.0)
            shown.add(slot)
        for slot, (mocap, geoms, _) in self.slots.items():
            if slot not in shown:
                d.mocap_pos[mocap] = (0, 0, -10)
                m.geom_group[geoms] = HIDDEN_GROUP

    def render(self, x: float, y: float, yaw_deg: float, pitch_deg: float) -> np.ndarray:
        """RGB frame [height, width, 3] uint8 from the agent's eye at (x, y) facing yaw, tilted pitch."""
        self.data.mocap_pos[self.agent_mocap] = (x, y, self.eye_height)
        self.data.mocap_quat[self.agent_mocap] = yaw_pitch_quat(yaw_deg, pitch_deg)
        mujoco.mj_kinematics(self.model, self.data)  # body and geom poses
        mujoco.mj_camlight(self.model, self.data)  # camera poses (not part of mj_kinematics)
        renderer = self.renderer
        renderer.update_scene(self.data, camera=self.camera_id, scene_option=self.option)
        return renderer.render()

