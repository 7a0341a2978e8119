"""Resource alarms: memory and disk watermarks, psutil probes, the watchdog."""
