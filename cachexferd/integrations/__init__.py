"""Engine plug-ins. Nothing else in cachexferd imports this package; each plug-in imports
its engine and is only importable where that engine is installed."""
