"""Procedural visual question answering: seeded synthetic scenes, charts and diagrams with exact answers."""
