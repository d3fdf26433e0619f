"""Operations: the registry, the base class and one folder per device."""
