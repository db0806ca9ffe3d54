"""The reduce path (CrossDeviceOps), the cross-replica collective check and the collective trace."""
