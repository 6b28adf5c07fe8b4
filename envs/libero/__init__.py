"""LIBERO: the gym env (`env`, through `lerobot[libero]`) and the `libero` task (`task`).

Nothing is imported here, so loading the task's module does not start robosuite or a GL backend.
"""
