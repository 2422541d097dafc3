"""The same run placed on a Ray cluster: the driver, the collector and learner actors, and the
``RaySettings`` a pipeline file declares. Ray is an optional extra; only this package imports it.
"""
