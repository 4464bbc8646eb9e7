"""``python -m dfccl.net``: compiles the network proxy against the installed
UCX (once; cached) and says where it is."""

from dfccl.net._build import library_path, load

if __name__ == "__main__":
    load()
    print(f"dfccl: network proxy ready: {library_path()}")
