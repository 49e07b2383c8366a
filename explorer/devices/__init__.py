"""Devices: what a cluster is made of (records, GPU presets, discovery of what is here)."""

from explorer.devices.cluster import Cluster, Device, Link, parse_devices

__all__ = ["Cluster", "Device", "Link", "parse_devices"]
