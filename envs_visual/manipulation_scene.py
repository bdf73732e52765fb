"""The MuJoCo side of the manipulation environment: the tabletop model (`assets/manipulation/
tabletop.xml`), its offscreen renderer, and the scripted controllers behind the primitive skills.

One `TabletopScene` per environment compiles the model once and opens one `mujoco.Renderer` on the
first frame. A level only rewrites poses, colours and which object slots are awake; nothing is
recompiled after construction.

The gripper is a hand on three slide joints (it never tilts) held to the mocap body `target` by a
point constraint, with two fingers on slide joints driven by position actuators. The controllers
move `target` through waypoints at fixed speeds, one physics step at a time, so that a grasp holds
by the fingers' contact forces and friction, a push shoves objects by contact, and whatever the
hand runs into stops it. Units here are metres and seconds; the environment speaks millimetres.

Rendering (the `MUJOCO_GL` backend, the renderer's lifetime) is `envs_visual.mujoco_render`'s.
"""

from __future__ import annotations

import copy
import xml.etree.ElementTree as ET
from dataclasses import dataclass

import numpy as np

from envs_visual.assets import asset_path
from envs_visual.mujoco_render import OffscreenScene, mujoco

CUBE_SLOTS = ("cube_0", "cube_1", "cube_2", "cube_3")  # 40 mm cubes
BLOCK_SLOT = "block"  # a 60 mm block, wider than the gripper opens
SLOTS = (*CUBE_SLOTS, BLOCK_SLOT)
GOAL_GEOMS = ("goal_0", "goal_1")
FINGER_GEOMS = ("left_finger", "right_finger")

HOME = np.array([0.0, 0.0, 0.15])  # where the hand waits between episodes (metres)
SAFE_Z = 0.15  # travel height of the grasp point: above a held cube over a stack of two
OPEN, CLOSED = 0.028, 0.0  # finger joint targets: a 56 mm gap, or pressed together
TRAVEL_SPEED = 0.5  # m/s of the mocap target between waypoints in the air
DESCENT_SPEED = 0.25  # m/s when lowering towards something
PUSH_SPEED = 0.15  # m/s along a push
GRIP_TIME = 0.25  # s to close or open the fingers
SETTLE_TIME = 0.06  # s at each waypoint for the hand to catch up with the target
PARKED_Z = -0.3  # unused object slots float here, under the table top, hidden and without contacts
HIDDEN_GROUP = 5
LANDED_LAG = 0.004  # m the hand may trail the target in a descent before it counts as landed (free: < 2 mm)


@dataclass
class Outcome:
    """What a controller did: whether it completed, and why not."""

    ok: bool
    landed_at: float | None = None  # grasp-point height (m) where a descent was stopped by a contact
    grasped: str | None = None  # the slot between the fingers after a pick


class TabletopScene(OffscreenScene):
    """The compiled tabletop, its physics state and one offscreen renderer."""

    env_name = "manipulation"

    def __init__(self, width: int = 168, height: int = 168):
        self.width, self.height = int(width), int(height)
        root = ET.parse(asset_path("manipulation", "tabletop.xml")).getroot()
        root.find("visual/global").attrib.update(offwidth=str(self.width), offheight=str(self.height))
        self.model = mujoco.MjModel.from_xml_string(ET.tostring(root, encoding="unicode"))
        self.data = mujoco.MjData(self.model)
        m = self.model

        def body(name: str) -> int:
            return mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_BODY, name)

        def geom(name: str) -> int:
            return mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_GEOM, name)

        self.slot_body = {s: body(s) for s in SLOTS}
        self.slot_geom = {s: geom(s) for s in SLOTS}
        self.geom_slot = {g: s for s, g in self.slot_geom.items()}
        self.slot_qpos = {s: int(m.jnt_qposadr[m.body_jntadr[b]]) for s, b in self.slot_body.items()}
        self.slot_dof = {s: int(m.jnt_dofadr[m.body_jntadr[b]]) for s, b in self.slot_body.items()}
        self.goal_geoms = [geom(g) for g in GOAL_GEOMS]
        self.finger_geoms = np.array([geom(g) for g in FINGER_GEOMS])
        self.mocap = int(m.body_mocapid[body("target")])
        self.hand_qpos = [int(m.jnt_qposadr[mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_JOINT, j)])
                          for j in ("hand_x", "hand_y", "hand_z")]
        self.finger_qpos = [int(m.jnt_qposadr[mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_JOINT, j)])
                            for j in FINGER_GEOMS]
        self.camera = mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_CAMERA, "front")
        self.half_size = {s: float(m.geom_size[g][0]) for s, g in self.slot_geom.items()}
        self.option = mujoco.MjvOption()
        self.option.geomgroup[HIDDEN_GROUP] = 0
        self.sim_time = 0.0  # simulated seconds since the last load
        # with `record_every` (seconds), the controllers append a frame that often to `recorded` (for
        # videos of the motion itself; rendering reads the state and never changes the physics)
        self.record_every: float | None = None
        self.recorded: list[np.ndarray] = []
        self._renderer: mujoco.Renderer | None = None

    def __deepcopy__(self, memo):
        """A copy with its own physics state and no renderer (it opens one if it ever renders)."""
        clone = copy.copy(self)
        clone.model = copy.deepcopy(self.model, memo)
        clone.data = copy.deepcopy(self.data, memo)
        clone.option = mujoco.MjvOption()
        clone.option.geomgroup[HIDDEN_GROUP] = 0
        clone._renderer = None
        return clone

    # -- level ----------------------------------------------------------------------------------
    def load(self, objects: list[tuple[str, tuple[float, float, float, float], float, float]],
             goals: list[tuple[float, float, tuple[float, float, float, float]]]) -> None:
        """Start a level: `objects` are (slot, rgba, x, y) resting on the table, `goals` are
        (x, y, rgba) marker discs; the hand waits at HOME with its fingers open."""
        m, d = self.model, self.data
        mujoco.mj_resetData(m, d)
        used = {slot for slot, *_ in objects}
        for slot in SLOTS:
            b, g, q = self.slot_body[slot], self.slot_geom[slot], self.slot_qpos[slot]
            awake = slot in used
            m.body_gravcomp[b] = 0.0 if awake else 1.0
            m.geom_contype[g] = m.geom_conaffinity[g] = 1 if awake else 0
            m.geom_group[g] = 0 if awake else HIDDEN_GROUP
            d.qpos[q:q + 7] = (0.0, 0.0, PARKED_Z, 1.0, 0.0, 0.0, 0.0)
        for slot, rgba, x, y in objects:
            q = self.slot_qpos[slot]
            d.qpos[q:q + 7] = (x, y, self.half_size[slot], 1.0, 0.0, 0.0, 0.0)
            m.geom_rgba[self.slot_geom[slot]] = rgba
        for k, g in enumerate(self.goal_geoms):
            if k < len(goals):
                x, y, rgba = goals[k]
                m.geom_pos[g] = (x, y, 0.0007)
                m.geom_rgba[g] = rgba
                m.geom_group[g] = 0
            else:
                m.geom_pos[g] = (0.0, 0.0, -0.5)
                m.geom_group[g] = HIDDEN_GROUP
        d.qpos[self.hand_qpos] = HOME
        d.mocap_pos[self.mocap] = HOME
        d.qpos[self.finger_qpos] = OPEN
        d.ctrl[:] = OPEN
        self.sim_time = 0.0
        mujoco.mj_forward(m, d)

    def set_object(self, slot: str, x: float, y: float, z: float | None = None) -> None:
        """Put an awake object at (x, y, z) upright and at rest (z: its resting height by default)."""
        q, v = self.slot_qpos[slot], self.slot_dof[slot]
        z = self.half_size[slot] if z is None else z
        self.data.qpos[q:q + 7] = (x, y, z, 1.0, 0.0, 0.0, 0.0)
        self.data.qvel[v:v + 6] = 0.0
        mujoco.mj_forward(self.model, self.data)

    # -- state ----------------------------------------------------------------------------------
    def position(self, slot: str) -> np.ndarray:
        """Centre of an object (metres), a copy."""
        return self.data.xpos[self.slot_body[slot]].copy()

    def tilt(self, slot: str) -> float:
        """Degrees between the object's up axis and the world's."""
        z_axis = self.data.xmat[self.slot_body[slot]].reshape(3, 3)[:, 2]
        return float(np.degrees(np.arccos(np.clip(z_axis[2], -1.0, 1.0))))

    def yaw(self, slot: str) -> float:
        """Rotation of the object about the vertical, folded into [-45, 45) degrees (a cube's symmetry)."""
        x_axis = self.data.xmat[self.slot_body[slot]].reshape(3, 3)[:, 0]
        angle = float(np.degrees(np.arctan2(x_axis[1], x_axis[0])))
        return (angle + 45.0) % 90.0 - 45.0

    def hand(self) -> np.ndarray:
        """The grasp point: the middle between the fingertips' pads (metres), a copy."""
        return self.data.qpos[self.hand_qpos].copy()

    def finger_opening(self) -> float:
        """Gap between the fingers' pads (metres)."""
        return float(self.data.qpos[self.finger_qpos].sum())

    def _contacts(self) -> tuple[np.ndarray, np.ndarray]:
        """Geom pairs [ncon, 2] and contact normals [ncon, 3] of the current contacts."""
        n = self.data.ncon
        if n == 0:
            return np.zeros((0, 2), dtype=int), np.zeros((0, 3))
        contact = self.data.contact
        return np.asarray(contact.geom[:n]), np.asarray(contact.frame[:n, :3])

    def between_fingers(self) -> str | None:
        """The object both fingers touch, if any."""
        pairs, _ = self._contacts()
        touching = [set(), set()]
        for a, b in pairs:
            for k, finger in enumerate(self.finger_geoms):
                if a == finger and b in self.geom_slot:
                    touching[k].add(self.geom_slot[b])
                elif b == finger and a in self.geom_slot:
                    touching[k].add(self.geom_slot[a])
        both = sorted(touching[0] & touching[1])
        return both[0] if both else None

    def _landed(self) -> bool:
        """Whether the hand trails its target upwards: something under it (or under what it holds)
        stops a descent. Cheaper than reading contacts every physics step."""
        return float(self.data.qpos[self.hand_qpos[2]] - self.data.mocap_pos[self.mocap, 2]) > LANDED_LAG

    # -- controllers ----------------------------------------------------------------------------
    def _step(self, n: int = 1) -> None:
        dt = self.model.opt.timestep
        if self.record_every is None:
            mujoco.mj_step(self.model, self.data, nstep=n)
            self.sim_time += n * dt
            return
        every = max(1, round(self.record_every / dt))
        for _ in range(n):
            mujoco.mj_step(self.model, self.data)
            self.sim_time += dt
            if round(self.sim_time / dt) % every == 0:
                self.recorded.append(self.render())

    def settle(self, seconds: float = SETTLE_TIME) -> None:
        self._step(max(1, round(seconds / self.model.opt.timestep)))

    def grip(self, opening: float) -> None:
        """Drive both fingers to `opening` (a joint target each) and wait GRIP_TIME."""
        self.data.ctrl[:] = opening
        self.settle(GRIP_TIME)

    def move(self, goal, speed: float, stop_on_landing: bool = False) -> Outcome:
        """Move the target in a straight line to `goal` at `speed`, one physics step at a time. With
        `stop_on_landing`, stop where the hand (or what it holds) first lands on something."""
        dt = self.model.opt.timestep
        start = self.data.mocap_pos[self.mocap].copy()
        goal = np.asarray(goal, dtype=np.float64)
        steps = max(1, int(np.ceil(np.linalg.norm(goal - start) / (speed * dt))))
        for i in range(1, steps + 1):
            self.data.mocap_pos[self.mocap] = start + (goal - start) * (i / steps)
            self._step()
            if stop_on_landing and self._landed():
                # hold where the hand is now instead of pressing on towards the target
                self.data.mocap_pos[self.mocap] = self.hand()
                self.settle()
                return Outcome(False, landed_at=float(self.hand()[2]))
        self.settle()
        return Outcome(True)

    def travel(self, x: float, y: float) -> None:
        """Rise to SAFE_Z where the hand is, then fly level to above (x, y)."""
        here = self.data.mocap_pos[self.mocap].copy()
        if here[2] < SAFE_Z - 1e-6:
            self.move((here[0], here[1], SAFE_Z), TRAVEL_SPEED)
        self.move((x, y, SAFE_Z), TRAVEL_SPEED)

    def pick(self, x: float, y: float, z: float) -> Outcome:
        """Open, travel above (x, y), lower the grasp point to z (stopping on anything the hand lands
        on), close the fingers, rise to SAFE_Z. `grasped` is the object held at the end."""
        self.data.ctrl[:] = OPEN
        self.travel(x, y)
        descent = self.move((x, y, z), DESCENT_SPEED, stop_on_landing=True)
        self.grip(CLOSED)
        self.move((x, y, SAFE_Z), DESCENT_SPEED)
        held = self.between_fingers()
        mujoco.mj_kinematics(self.model, self.data)  # poses of the final state (mj_step leaves them one step old)
        return Outcome(held is not None, landed_at=descent.landed_at, grasped=held)

    def place(self, slot: str, x: float, y: float, z: float) -> Outcome:
        """Carry the held object so that its centre goes to (x, y, z), lowering until it (or the hand)
        lands on something, then open the fingers and rise to SAFE_Z."""
        offset = self.position(slot) - self.hand()  # where the object sits relative to the grasp point
        self.travel(x - offset[0], y - offset[1])
        descent = self.move((x - offset[0], y - offset[1], z - offset[2]), DESCENT_SPEED, stop_on_landing=True)
        self.grip(OPEN)
        here = self.hand()
        self.move((here[0], here[1], SAFE_Z), DESCENT_SPEED)
        self.settle(0.2)  # let what was released come to rest before anyone reads its pose
        mujoco.mj_kinematics(self.model, self.data)
        return Outcome(True, landed_at=descent.landed_at)

    def push(self, start, end) -> Outcome:
        """Close the fingers, travel above `start`, lower to it (failing if the hand lands on
        something first), sweep in a straight line to `end`, rise to SAFE_Z."""
        self.grip(CLOSED)
        self.travel(start[0], start[1])
        descent = self.move(start, DESCENT_SPEED, stop_on_landing=True)
        if not descent.ok:
            here = self.hand()
            self.move((here[0], here[1], SAFE_Z), DESCENT_SPEED)
            mujoco.mj_kinematics(self.model, self.data)
            return descent
        self.move(end, PUSH_SPEED)
        here = self.hand()
        self.move((here[0], here[1], SAFE_Z), DESCENT_SPEED)
        self.settle(0.2)
        mujoco.mj_kinematics(self.model, self.data)
        return Outcome(True)

    # -- rendering ------------------------------------------------------------------------------

    def render(self) -> np.ndarray:
        """RGB frame [height, width, 3] uint8 from the fixed front camera."""
        renderer = self.renderer
        renderer.update_scene(self.data, camera=self.camera, scene_option=self.option)
        return renderer.render()

