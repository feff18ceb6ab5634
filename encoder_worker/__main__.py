from common.runtime.worker import main
from encoder_worker.stage import EncoderStage

if __name__ == "__main__":
    main(EncoderStage)
