class FastMLState: pass
def register_hook(*a, **k): raise NotImplementedError
