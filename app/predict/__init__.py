"""The predict front ends over the detector core (app/pipeline): folders, videos and live streams.

The CLI, the service's streams and the Ray job import them; nothing in the core imports them.
"""
