# The C API's table (cuda/include/dfccl/dfccl_api.h) in a PyCapsule.
API_VERSION: int
CAPSULE_NAME: str
api: object
def api_capsule() -> object: ...
