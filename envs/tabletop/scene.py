"""The MJCF of the tabletop scenes: a floating two-finger gripper over a table, plus objects.

The gripper is a body on three slide joints (x, y, z) driven by stiff position servos, with two
slide fingers driven by weaker position servos; gravity compensation keeps it from sagging. So
the arm is a real dynamic body that pushes and squeezes through contacts (no teleporting mocap),
while staying much cheaper than a 7-joint arm. Objects are free bodies (blocks) or static balls;
zones are flat non-colliding patches. Colours and positions are set per episode, so one compiled
model serves every initial state of a task.
"""

from __future__ import annotations

from dataclasses import dataclass

# Geometry shared by the scene, the success checks and the scripted experts (metres).
BLOCK_HALF = 0.02
BALL_RADIUS = 0.025
ZONE_HALF = 0.05
FINGER_OPEN = 0.045  # finger joint travel: inner faces at +-q from the gripper's centre plane
FINGER_BOTTOM = -0.02  # fingertips sit this far below the tool centre point (tcp)
WORKSPACE_LOW = (-0.3, -0.3, 0.02)
WORKSPACE_HIGH = (0.3, 0.3, 0.35)

TIMESTEP = 0.002  # physics step; 25 sub-steps make one 20 Hz control step
N_SUBSTEPS = 25


@dataclass(frozen=True)
class SceneLayout:
    n_blocks: int = 0
    n_balls: int = 0
    n_zones: int = 0


def _gripper() -> str:
    finger = (
        '<body name="finger_{s}" pos="0 0 0" gravcomp="1">'
        '<joint name="finger_{s}" type="slide" axis="0 {sign}1 0" range="0 {open}" damping="2"/>'
        '<geom name="finger_{s}" type="box" pos="0 {sign}0.006 0.005" size="0.012 0.006 0.025" mass="0.03"'
        ' rgba="0.25 0.25 0.28 1" friction="1.5 0.02 0.001" condim="4"/>'
        "</body>"
    )
    return (
        '<body name="ee" pos="0 0 0" gravcomp="1">'
        '<joint name="ee_x" type="slide" axis="1 0 0" range="{lx} {hx}" damping="5"/>'
        '<joint name="ee_y" type="slide" axis="0 1 0" range="{ly} {hy}" damping="5"/>'
        '<joint name="ee_z" type="slide" axis="0 0 1" range="{lz} {hz}" damping="5"/>'
        '<site name="tcp" pos="0 0 0" size="0.004" rgba="1 1 1 0"/>'
        '<geom name="palm" type="box" pos="0 0 0.04" size="0.015 0.055 0.01" mass="0.2" rgba="0.35 0.35 0.4 1"/>'
        # A visual-only column so the front camera sees an "arm" coming from above.
        '<geom name="column" type="cylinder" fromto="0 0 0.05 0 0 0.5" size="0.01" contype="0" conaffinity="0"'
        ' mass="0.01" rgba="0.6 0.6 0.65 1"/>'
        '<camera name="wrist" pos="0 0 0.028" xyaxes="0 -1 0 1 0 0" fovy="80"/>'
        # Overhead and gripper-centred (it rides on the gripper, far above it): the gripper is always
        # at the image centre, so a target's pixel offset from the centre is its offset from the gripper.
        '<camera name="follow" pos="0 0 1.9" xyaxes="1 0 0 0 1 0" fovy="16"/>'
        + finger.format(s="l", sign="", open=FINGER_OPEN)
        + finger.format(s="r", sign="-", open=FINGER_OPEN)
        + "</body>"
    ).format(lx=WORKSPACE_LOW[0], hx=WORKSPACE_HIGH[0], ly=WORKSPACE_LOW[1], hy=WORKSPACE_HIGH[1],
             lz=WORKSPACE_LOW[2], hz=WORKSPACE_HIGH[2])


def build_mjcf(layout: SceneLayout) -> str:
    """MJCF text for `layout`; objects start parked and grey until an episode places them."""
    blocks = "".join(
        f'<body name="block{i}" pos="{0.5 + 0.1 * i} 0.5 {BLOCK_HALF}"><freejoint name="block{i}"/>'
        f'<geom name="block{i}" type="box" size="{BLOCK_HALF} {BLOCK_HALF} {BLOCK_HALF}" mass="0.05"'
        ' rgba="0.5 0.5 0.5 1" friction="1 0.01 0.001" condim="4"/></body>'
        for i in range(layout.n_blocks)
    )
    balls = "".join(
        # One static body per ball: moving a body is safe at runtime, while moving a geom of the
        # world body would leave MuJoCo's precompiled bounding-volume tree stale (no contacts).
        f'<body name="ball{i}" pos="{0.5 + 0.1 * i} -0.5 {BALL_RADIUS}">'
        f'<geom name="ball{i}" type="sphere" size="{BALL_RADIUS}" rgba="0.5 0.5 0.5 1"/></body>'
        for i in range(layout.n_balls)
    )
    zones = "".join(
        f'<geom name="zone{i}" type="box" size="{ZONE_HALF} {ZONE_HALF} 0.001" pos="{-0.5 - 0.15 * i} 0 0.001"'
        ' contype="0" conaffinity="0" rgba="0.5 0.5 0.5 1"/>'
        for i in range(layout.n_zones)
    )
    return f"""
<mujoco model="mmrl_tabletop">
  <compiler angle="radian"/>
  <option timestep="{TIMESTEP}" cone="elliptic" impratio="10" integrator="implicitfast"/>
  <visual>
    <quality shadowsize="0"/>
    <headlight ambient="0.45 0.45 0.45" diffuse="0.4 0.4 0.4" specular="0 0 0"/>
    <global offwidth="512" offheight="512"/>
  </visual>
  <worldbody>
    <light pos="0 -0.3 1.2" dir="0 0.25 -1" castshadow="false" diffuse="0.5 0.5 0.5"/>
    <geom name="table" type="plane" size="1.2 1.2 0.02" rgba="0.78 0.68 0.55 1" friction="1 0.01 0.001"/>
    <camera name="front" pos="0 -0.36 0.36" xyaxes="1 0 0 0 0.707 0.707" fovy="55"/>
    <!-- Straight down from far above (nearly orthographic), framing the object area: pixel position is
         table position, so a small vision tower can localise the target and the gripper. -->
    <camera name="top" pos="0 0 2.0" xyaxes="1 0 0 0 1 0" fovy="14"/>
    {zones}{balls}{blocks}
    {_gripper()}
  </worldbody>
  <contact><exclude body1="finger_l" body2="finger_r"/></contact>
  <actuator>
    <position name="ee_x" joint="ee_x" kp="800" dampratio="1" ctrlrange="{WORKSPACE_LOW[0]} {WORKSPACE_HIGH[0]}" forcerange="-40 40"/>
    <position name="ee_y" joint="ee_y" kp="800" dampratio="1" ctrlrange="{WORKSPACE_LOW[1]} {WORKSPACE_HIGH[1]}" forcerange="-40 40"/>
    <position name="ee_z" joint="ee_z" kp="800" dampratio="1" ctrlrange="{WORKSPACE_LOW[2]} {WORKSPACE_HIGH[2]}" forcerange="-40 40"/>
    <position name="finger_l" joint="finger_l" kp="300" dampratio="1" ctrlrange="0 {FINGER_OPEN}" forcerange="-10 10"/>
    <position name="finger_r" joint="finger_r" kp="300" dampratio="1" ctrlrange="0 {FINGER_OPEN}" forcerange="-10 10"/>
  </actuator>
</mujoco>
"""
